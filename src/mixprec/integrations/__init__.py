"""Integrations of mixprec with third-party trainers (optional extras)."""
