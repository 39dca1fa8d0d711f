"""Reasoning parsers: a model's answer split into its reasoning and its content.

Plain classes over text, nothing of HTTP (the server's chat glue is
kvserve.serve.request.reasoning): one file per parser, `registry.py` names them with
vLLM's `--reasoning-parser` names.
"""
