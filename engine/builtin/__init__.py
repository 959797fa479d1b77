"""The builtin plugins: the defaults, written with the same hooks third parties use.

They are always registered (as ``builtin.<module>``), are called after every enabled plugin,
and their registered names are replaced by an enabled plugin that registers the same name.
"""
