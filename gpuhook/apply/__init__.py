"""The only stage that changes the system: carries out a Plan (docs/architecture.md)."""
