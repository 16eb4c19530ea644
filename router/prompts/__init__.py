"""Prompts as the engine sees them: the prompt types, the model's tokenizer and chat templates as vLLM serves them, the
cached prompt tokenizer, request templates."""
