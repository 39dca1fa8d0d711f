"""Reading a checkpoint: what a path names (HF directory or GGUF file), its config, its
weights' names and tensors, its tokenizer.

No torch at import for the path, the config and the tokenizer (the router reads
tokenizers without loading the model); imports no other model room.
"""
