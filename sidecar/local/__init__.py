"""Local stand-ins for cluster services (an S3 server), for tests, demos and `strata launch`."""
