"""The demos (`kvd demo`: a verified regrouped transfer; `kvd demo --model`: a small transformer's
prefill -> decode through kvd, in :mod:`kvd.demo.model`) and the helpers they, the benchmarks and
the tests use to start daemons."""
