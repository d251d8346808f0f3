"""rlyard's SGLang-compatible inference engine (CPU or one GPU): `python -m services.engine`."""
