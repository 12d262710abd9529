"""The Python API: Model and load(), and OpenAI's requests and answers."""
