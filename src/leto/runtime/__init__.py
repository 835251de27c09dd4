"""What every Leto process stands on: its job's environment (`env`), its process groups
(`comm`), heartbeats and the generation watch (`membership`), zygotes, and Linux calls."""
