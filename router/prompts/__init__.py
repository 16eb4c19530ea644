"""Prompts as the engine sees them: the model's tokenizer and chat template, request templates."""
