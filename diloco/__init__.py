"""The operations layer: the ``diloco`` command (:mod:`diloco.cli`), ``diloco up`` (:mod:`diloco.up`),
``diloco auth`` (:mod:`diloco.auth` and its parts) and the broker topologies of ``diloco up``
(:mod:`diloco.topology`). It may import the roles (``learner``, ``aggregator``, ``monitor``) and
the bus; neither imports it (docs/ARCHITECTURE.md, "Layers").
"""
