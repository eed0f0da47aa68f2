"""The `pkv bench` subcommands, one module each: options, checks of the user's input, and
what is printed. Each imports its machinery (pkv.cli.bench.<name>, torch, httpx, the engine)
inside the command, so that building the command line imports none of it."""
