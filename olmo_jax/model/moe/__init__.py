"""Mixture-of-experts feed-forward: router -> dispatch -> experts -> combine, plus losses."""
