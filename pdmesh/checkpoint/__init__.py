"""A model's files on disk, without torch: where they are (a Hugging Face folder, a GGUF file
converted once, the embedded default) and what the router needs to know from them."""
