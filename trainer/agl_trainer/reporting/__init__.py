"""What a run shows and leaves: the progress display and step lines (``display``), metrics records
(``results``), experiment trackers and a rollout's explanation for the dashboard (``explain``)."""
