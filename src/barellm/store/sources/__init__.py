"""Where models come from besides barellm's own catalogue: Hugging Face and Ollama."""
