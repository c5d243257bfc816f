"""The system's algorithm and failure behaviour, simulated in one process, before or beside a deployment.

- :mod:`simulation.reference`: the algorithm on a virtual clock: M learners and one aggregator
  composed of the roles' own pure functions (no NATS, no processes); its configuration
  (:mod:`simulation.reference_config`), model and data (:mod:`simulation.reference_setup`) and the
  Byzantine learners' attacks (:mod:`simulation.byzantine_attacks`, shared with the system
  benchmark's lying learner);
- :mod:`simulation.goodput_model`: the goodput model (pure, numpy only): failure streams, the modes
  and their accounting, at paper scale and against ``bench.goodput``'s measured runs.

Layer: above the roles and the bus (it imports ``learner``, ``aggregator``, ``bus``), below the
operations layer (``diloco simulate`` drives it); the benchmarks in ``bench/`` import it, it never
imports ``bench`` (docs/ARCHITECTURE.md, "Layers").
"""
