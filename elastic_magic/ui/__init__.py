"""Renderers: they consume agent events and never drive the agent."""
