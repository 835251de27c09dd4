"""Leto: fault-tolerant training that recovers in place."""
