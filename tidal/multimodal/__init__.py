"""Image inputs: decoding and limits (:mod:`.decode`), fetching (:mod:`.fetch`), the image
processor (:mod:`.preprocess`) and the tower's output cache (:mod:`.encoder_cache`)."""

from tidal.multimodal.decode import ImageError, ImageLimits, decode_image
from tidal.multimodal.preprocess import ImageInput, navit_resize, preprocess_image

__all__ = ["ImageError", "ImageInput", "ImageLimits", "decode_image", "navit_resize", "preprocess_image"]
