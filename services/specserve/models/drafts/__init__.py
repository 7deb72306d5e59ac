"""Drafts: the distilled subset-vocabulary draft (`subset`, shipped for the embedded target in
`smollm2-135m-instruct-draft/`), the feature head on the target's hidden states (`head`) and prompt lookup
(`ngram`).

The top room of `models/`: built on all the others.
"""
