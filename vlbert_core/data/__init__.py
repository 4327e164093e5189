"""Raw data → webdataset shards: Conceptual Captions images (reader → downloader → resizer →
writer → accounting) and the text-only corpora (BooksCorpus, Wikipedia)."""

from vlbert_core.data.cc import download_cc_shard, make_downloader
from vlbert_core.data.downloader import USER_AGENT, Downloader, FetchResult
from vlbert_core.data.logger import ShardAccounting, write_stats
from vlbert_core.data.reader import CCRow, count_rows, iter_cc_tsv, num_shards_of, read_cc_tsv, shard_bounds
from vlbert_core.data.resizer import ImageRejected, ResizedImage, resize_image
from vlbert_core.data.text import iter_wiki_pages, shard_text_corpus, split_sentences, strip_wikitext
from vlbert_core.data.writer import TarShardWriter, cc_key, text_key

__all__ = [
    "USER_AGENT",
    "CCRow",
    "Downloader",
    "FetchResult",
    "ImageRejected",
    "ResizedImage",
    "ShardAccounting",
    "TarShardWriter",
    "cc_key",
    "count_rows",
    "download_cc_shard",
    "iter_cc_tsv",
    "iter_wiki_pages",
    "make_downloader",
    "read_cc_tsv",
    "resize_image",
    "num_shards_of",
    "shard_bounds",
    "shard_text_corpus",
    "split_sentences",
    "strip_wikitext",
    "text_key",
    "write_stats",
]
