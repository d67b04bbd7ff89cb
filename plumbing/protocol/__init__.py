"""Every Lua script sluice runs on Redis, with the functions that build its KEYS: the protocols the
services share over Redis, each written once. No module outside this package defines a script."""
