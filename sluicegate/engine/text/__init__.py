"""Text in and out: tokenizer and detokenizer, chat templates, prompts, reasoning split, choices, tool-call parsers."""
