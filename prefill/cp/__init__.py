"""The CP prefill engine: rank processes (or threads), their runner and page source."""
