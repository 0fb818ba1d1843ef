"""What the server tells its operator: request counts and latencies, the access log, and the
Prometheus exposition that reads them and every other part's numbers at scrape time."""
