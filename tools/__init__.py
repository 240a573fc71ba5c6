"""Developer tooling: environment install checks (doctor)."""
