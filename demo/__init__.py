"""The `make demo` cluster: a training job on simulated nodes that survives injected failures.

Modules: :mod:`demo.faults` (which failures, when: pure), :mod:`demo.report` (what the run
kept, and what a persistent-only setup would have: pure), :mod:`demo.cluster` (server and
agent processes), :mod:`demo.supervisor` (launches and relaunches the job),
:mod:`demo.injector` (makes a drawn failure real), :mod:`demo.prometheus` (the optional
Prometheus of ``DEMO_PROMETHEUS=1``), :mod:`demo.run` (the command).
"""
