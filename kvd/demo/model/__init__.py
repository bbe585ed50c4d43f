"""A small transformer served through kvd: ctx TP1 prefill → gen TP2/TP4 decode, token-identical.

The reference integration for a serving framework: :mod:`~kvd.demo.model.ctx` and
:mod:`~kvd.demo.model.gen` are the executors (what a framework's context and generation
workers do with kvd), :mod:`~kvd.demo.model.paged` the paged KV cache over a kvd pool,
:mod:`~kvd.demo.model.transformer` the model with its tensor-parallel shard,
:mod:`~kvd.demo.model.reference` the single-process reference and the comparison;
:mod:`~kvd.demo.model.run` is the driver (it plays the router, over the pipes of
:mod:`~kvd.demo.model.control`), :mod:`~kvd.demo.model.daemons` starts the two daemons,
:mod:`~kvd.demo.model.options` and :mod:`~kvd.demo.model.cli` are ``kvd demo --model``.
"""
