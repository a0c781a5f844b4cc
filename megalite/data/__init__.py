"""Data pipeline: tokenizers, Megatron-format indexed datasets, GPT samples, blending.

Entry points: ``tokenizers.build_tokenizer``, ``builder.build_train_valid_test_datasets``
and ``default_corpus.prepare_default_corpus``; see each module. Submodules are
imported lazily by callers so that importing ``megalite.data`` stays cheap.
"""
