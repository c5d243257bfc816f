"""Model presets: a named set of ``DILOCO_*`` values for the built-in model's shape (and its batch
and fragment count), which every process of a run must agree on.

``DILOCO_MODEL_PRESET=small`` gives any role these values (:func:`bus.config.from_env` puts them
under the environment and ``DILOCO_ENV_FILE``'s: an explicit ``DILOCO_*`` wins); ``diloco up
--model-preset`` uses the same table. Pure data: the one source of truth for the presets.
"""

from __future__ import annotations

#: Model presets: DILOCO_* values. ``default`` is the configuration's own defaults (836,736 params).
MODEL_PRESETS: dict[str, dict[str, str]] = {
    "tiny": {"DILOCO_D_MODEL": "32", "DILOCO_N_LAYERS": "2", "DILOCO_N_HEADS": "2", "DILOCO_D_FF": "64",
             "DILOCO_SEQ_LEN": "32", "DILOCO_NUM_FRAGMENTS": "4", "DILOCO_BATCH_SIZE": "8",
             "DILOCO_EVAL_BATCH_SIZE": "16"},
    "small": {"DILOCO_D_MODEL": "64", "DILOCO_N_LAYERS": "2", "DILOCO_N_HEADS": "4", "DILOCO_D_FF": "256",
              "DILOCO_SEQ_LEN": "64", "DILOCO_NUM_FRAGMENTS": "4", "DILOCO_BATCH_SIZE": "16"},
    "default": {},
}
