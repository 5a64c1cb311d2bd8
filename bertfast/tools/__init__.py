"""Every command (cli, demo, aot, bench/, validate/): a thin layer over the library, never imported by it."""
