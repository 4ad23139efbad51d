"""Files a command writes and identities of what it reads.

outputs      write an output directory or file atomically, never over an input or (without
             `overwrite`) over anything that already holds data
sizes        byte sizes such as "5GB" (`--max-shard-size`)
text_limits  untrusted text made safe: escaped for a terminal, refused as a path, JSON parsed
             with its size and depth bounded
"""
