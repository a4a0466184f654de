"""The memory tier on real ranks (gloo on 127.0.0.1, spawned processes): replicas on partner nodes,
draining a lost node's memory, incremental memory-tier steps of several ranks. The ``*_worker.py``
scripts here are spawned by path (``dist.launch.run_ranks`` with ``HERE / "<worker>.py"``) and import
``tests.dist.launch`` (``run_ranks`` puts the repository on every rank's ``PYTHONPATH``)."""
