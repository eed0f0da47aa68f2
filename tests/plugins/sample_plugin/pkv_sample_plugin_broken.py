"""A plugin whose import fails: pkv must report it and carry on."""

raise ImportError("this plugin needs a library that is not installed")
