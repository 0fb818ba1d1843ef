"""Running streams across several single-writer processes: placement, and the load balancer's view."""
