"""The wire protocol in one place: every store key (`keys`) and the typed messages written
under them (`messages`). It imports nothing else of Leto, so every layer may use it."""
