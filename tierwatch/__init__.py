"""tierwatch: find sick GPU nodes fast, and lose little training when a job comes back.

Installed layout: ``tierwatch.server`` (the control plane, source folder ``app/``) and
``tierwatch.agent`` (the node agent, source folder ``agent/``). Importing this package
imports neither torch nor the server.
"""

__version__ = "0.1.0"
