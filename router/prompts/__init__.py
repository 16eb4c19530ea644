"""Prompts as the engine sees them: the prompt types, the model's tokenizer and chat template, the cached prompt
tokenizer, request templates."""
