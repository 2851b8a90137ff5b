"""Sluicegate: one endpoint in front of many models. ``sluicegate.gateway`` (never imports torch),
``sluicegate.engine`` and ``sluicegate.kernels`` live under this one import name so that none of
ours can shadow another distribution's (Hugging Face's ``kernels``, which transformers imports).
"""
