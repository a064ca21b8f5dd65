"""The per-node pool service: one ``kvpool daemon`` owning the host pools (in shared memory), the
SSDs' index, placement and eviction for every engine on the node; engines reach it through
``RemotePool`` (scheduler side) and map its host pools in place (worker side).

``wire`` frames and checks the messages, ``daemon`` serves them, ``remote`` is the engine side.
"""
