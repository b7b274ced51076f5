"""Llama-family model (Llama 2/3, Mistral, Qwen2) built from explicit tensor-parallel layers, its Hugging
Face loader and tokenizer, and the deterministic tiny checkpoint maker."""
