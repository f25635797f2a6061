"""The model side: Llama-family layers, paged attention and the loader that fills their weights."""
