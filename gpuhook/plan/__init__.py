"""Pure: (request, host, config) -> Plan, the data `--dry-run` prints and tests compare."""
