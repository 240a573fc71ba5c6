"""Telemetry-driven routing: filters -> scorers -> weights -> ejection, as small pure steps."""
