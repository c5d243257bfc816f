"""``diloco up``: a whole run on one machine: broker, aggregator, monitor, evaluator and N learners.

Every role runs as its own OS process (``python -m diloco.cli <role>``), configured by ``DILOCO_*``
environment variables exactly as it would be on separate machines; the launcher only chooses the
values, starts the processes, watches the run through the ``metrics`` subjects and stops
everything at the end. Order of a run:

1. generate the run's credentials into ``OUT/auth`` (:func:`diloco.auth.init`: one account, one
   least-privilege user per role and per learner; new passwords every time) and start the broker
   (:mod:`diloco.topology`: one JetStream server with those accounts, or a hub plus one leaf-node
   server per region, each with the same account and users, the leaf links bound to the account
   with one new password per region: :mod:`diloco.auth_leaf`), its JetStream store under
   ``OUT/nats-store`` (wiped at start: every ``diloco up`` is a fresh run). Each role process gets
   its user's env file merged into its environment; the launcher itself connects as ``metrics``
   (read-only). ``--no-auth``: anonymous access as before, on every server of either topology;
2. start the aggregator (it creates version 0), the monitor and the evaluator; wait for the
   evaluator's first held-out loss of version 0 (the *initial* loss);
3. start the learners (``<region>-<i>``, spread round-robin over the regions, each on its own
   data shard), show live progress;
4. when every learner has finished its steps: wait for the last merges and one evaluation of the
   final global versions; on Ctrl-C/SIGTERM: stop at once;
5. stop learners, evaluator and monitor, then the aggregator (SIGTERM, SIGKILL after a timeout;
   the aggregator last so it merges what the learners sent), then the servers; write
   ``OUT/summary.json`` and ``OUT/eval_loss.png``. A signal at any instant of 1-5, the writing
   of the outputs too, ends here: status ``interrupted``, the phase in ``interrupted_during``
   (:mod:`diloco.up.launcher`, "Signals").

Children run in their own process group and get SIGKILL if the launcher dies
(``PR_SET_PDEATHSIG``), so no process outlives the launcher. Every child's stdout and stderr (JSON
log lines) go to ``OUT/logs/<name>.log``; ``OUT/processes.json`` lists pids and exit codes.

Precedence of settings: model preset and launcher defaults < the caller's ``DILOCO_*``
environment < explicit flags (``--steps``, ``--learners``, ...) < per-process identity
(``DILOCO_NATS_URL``, ``DILOCO_REGION``, ``DILOCO_LEARNER_ID``, shard).

The package, one concern a module: :mod:`diloco.up.plan` (arguments, presets, every child's
environment), :mod:`diloco.up.children` (child processes and their stopping),
:mod:`diloco.up.progress` (the live state folded from the metrics subjects and its views),
:mod:`diloco.up.summary` (``summary.json``, its text and ``eval_loss.png``) and
:mod:`diloco.up.launcher` (the phases of a run, ``main``).
"""

from diloco.up.children import Child, astop_children, stop_children  # noqa: F401
from diloco.up.launcher import WATCH_ENV, Launcher, main, previous_run, write_watch_env  # noqa: F401
from diloco.up.plan import (  # noqa: F401
    CENTRAL_REGION,
    DEFAULT_STEPS,
    PRESETS,
    QUICK_STEPS,
    ROLE_USERS,
    RUN_DEFAULTS,
    SINGLE_THREAD_XLA,
    ProcSpec,
    auth_enabled,
    base_env,
    learner_ids,
    parse_args,
    parse_regions,
    plan_processes,
    resolve_steps,
    user_of,
    validate_envs,
    with_credentials,
    with_urls,
)
from diloco.up.progress import RunState, show_progress  # noqa: F401
from diloco.up.summary import (  # noqa: F401
    build_summary,
    dp_equivalent_bytes,
    plot_eval,
    render_summary,
)
