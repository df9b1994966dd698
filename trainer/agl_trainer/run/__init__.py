"""A training run: the skeleton every job shares (``run_context``), its two step sources (``loop``:
online rollouts; ``offline``: stored traces), a step's rollouts and update (``step``, ``pipeline``,
``rollouts``), the services it starts (``services``, ``serving``), tasks (``data``) and traces
(``traces``)."""
