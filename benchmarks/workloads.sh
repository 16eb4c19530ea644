# The workloads the routing benchmarks share (sourced by capacity_matrix.sh and gateways.sh): kvgate bench arguments,
# at 8 replicas of 4,096 blocks (64k tokens each, 512k for the fleet) unless a script says otherwise.
TIGHT=(--kv-blocks 4096)
# 24 documents of 4k-15k tokens (working set 257k: more than a replica holds, half the fleet), a new question each.
DOCS=(--workload documents --documents 24 --document-tokens 4000:15000 --zipf 1.1 --requests 300 --time-scale 4)
# 80 sessions of 5 turns of 1,500 tokens (working set 626k, above the fleet's 512k).
TURNS=(--workload multi-turn --sessions 80 --turns 5 --turn-tokens 1500 --think-time 0.5 --time-scale 2)
# 32 agentic sessions growing toward 16k tokens on a 2,000-token shared prefix (working set ~650k).
AGENT=(--workload agentic --sessions 32 --turns 10 --context-tokens 16000 --system-tokens 2000 --think-time 0.5
       --idle-time 3 --subagent-prob 0.25 --time-scale 2)
# 16 groups of 64 questions on a 4,096-token system prompt each, at a rate that keeps the fleet busy.
SHARED=(--workload shared-prefix --groups 16 --prompts-per-group 64 --system-tokens 4096 --question-tokens 256
        --rate 60 --time-scale 2)
# 1,000 prompts that share nothing, 64 at a time: routing can only balance load.
UNIQUE=(--workload unique --requests 1000 --prompt-tokens 1024 --rate 1000 --concurrency 64 --time-scale 1)
# The Mooncake traces' first 600 requests that fit a replica, at 10x speed on the engines' real clock, 8-token blocks
# and 3,000 blocks per replica (24k tokens: a long prompt takes most of a replica's KV): the conversation trace, and
# the synthetic one (ShareGPT, L-Eval and LooGLE sessions, Poisson arrivals), which no policy parameter was tuned on.
REPLAY=(--workload trace --requests 600 --speed 10 --time-scale 1 --kv-blocks 3000 --max-input-tokens 23000
        --sim-args "--block-size 8 --max-model-len 24000")
TRACE=("${REPLAY[@]}" --trace benchmarks/traces/conversation_trace.jsonl)
SYNTH=("${REPLAY[@]}" --trace benchmarks/traces/synthetic_trace.jsonl)
# The conversation trace half an hour in (its first 600 requests after 1,800 s that fit a replica): a window nothing was
# tuned on, and more than the fleet can serve at 10x (every router's client TTFT averages ~28 s).
TRACE_LATE=("${REPLAY[@]}" --trace benchmarks/traces/conversation_trace.jsonl --window 1800:3540)
# The Azure LLM inference trace (conversation service): real arrivals and prompt and output lengths, no prefixes to
# reuse, at 10x speed (~55 requests/s).
AZURE=(--workload trace --trace benchmarks/traces/AzureLLMInferenceTrace_conv.csv --requests 1200 --speed 10
       --time-scale 1)
# The same trace's code-completion service, never tuned on: prompts of 2,073 tokens on average in bursts, ~26
# requests/s at 10x, no prefixes to reuse.
AZURE_CODE=(--workload trace --trace benchmarks/traces/AzureLLMInferenceTrace_code.csv --requests 1200 --speed 10
            --time-scale 1)
