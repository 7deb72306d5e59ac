"""What runs inside a target worker's process: the step scheduler that gives every session's work ONE batched
forward per step (`steps`), and whole sessions with the draft colocated in the worker (`colocated`).

The single-process library decoder (`engine`) needs none of it; the worker's gRPC servicers (`rpc`) drive it.
"""
