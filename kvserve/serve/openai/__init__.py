"""OpenAI's routes: /v1/chat/completions, /v1/completions, /v1/embeddings, /tokenize, /detokenize,
and vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (adapters.py).

One module per route family, each a handler that reads top-down: the body
parsed (request/), the prompt checked and submitted (generation/), the answer
joined or streamed (generation/stream.py). app.py wires them.
"""
