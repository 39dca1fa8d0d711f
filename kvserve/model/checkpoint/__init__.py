"""Reading a checkpoint: what a path names (HF directory or GGUF file), its config, its
weights' names and tensors, its tokenizer.

No torch at import for the path, the config and the tokenizer (the router reads
tokenizers without loading the model); imports no other model room.

Files:

    resolve.py      what a model path names: an HF directory or one GGUF file (every
                    reader of a checkpoint resolves the path here)
    config.py       ModelConfig from config.json or GGUF metadata
    errors.py       ModelLoadError: one line naming what is wrong, before any tensor
    tokenizer.py    the checkpoint's own tokenizer and chat template (no torch: the
                    router reads it through here)
    gguf_file.py    opening a GGUF file (gguf-py's memory-mapped reader) with clear errors
    layer_windows.py which layers slide: per-layer types (Gemma 2, 3), one window for
                    every layer (Mistral, Phi-3), or none (a window asked for is refused)
    longrope.py     Phi-3's longrope parameters (short / long factors picked per token)
    gguf_config.py  GGUF metadata -> the config dicts ModelConfig.from_dict takes
    gguf_families.py a GGUF family's own metadata (windows, Gemma 3's hard-coded
                    settings, Phi-3's rotary dims and longrope factor tensors)
    gguf_rope.py    GGUF rope scaling -> HF rope_scaling (Llama 3 from rope_freqs)
    gguf_weights.py GGUF tensors -> parameters: names, dequantization, q/k rows
    moe_config.py   the mixture-of-experts fields of a config (each family's spelling)
    gguf_moe.py     a GGUF file's experts: metadata -> those fields, stacked expert
                    tensors -> one slice per expert (the same bytes)
    weight_check.py names and shapes checked before any tensor is read (both formats)
"""
