"""The message transport behind one seam (:class:`pipeline.transport.base.Transport`).

:mod:`~pipeline.transport.factory` picks the implementation from the broker URL's
scheme; :mod:`~pipeline.transport.redis` is Dramatiq on Redis. Nothing outside this
package names a broker's private layout.
"""
