"""The demo (`kvd demo`) and the helpers it, the benchmarks and the tests use to start daemons."""
